"""The `tbegen` command line (also `python -m tbegen`).

    tbegen list                              the available optimizers and their summaries
    tbegen validate FILE...                  check specs; every problem as file:line[:col]: field: message
    tbegen render --optimizer NAME|PATH      write the sources of one optimizer (repeatable)
    tbegen render --all                      write every optimizer's sources (and prune stale files)
    tbegen check                             re-render in memory and diff against generated/
    tbegen test --optimizer NAME [--device]  build one optimizer and check it numerically
    tbegen schema [--out FILE]               the JSON Schema of the spec format (for editors)
    tbegen new NAME [--from SPEC] [--out DIR]  write a new spec NAME.yaml to start from

Specs are code, like a Makefile or setup.py: their C++ snippets are compiled into a library that
is loaded into the process, and their `reference` is Python that `tbegen test` executes. Use only
specs you trust.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from . import render as rnd
from .spec import SpecError, find_spec, list_specs, load_spec


def _load(name_or_path: str, run_reference: bool = False):
    try:
        return load_spec(str(find_spec(name_or_path)), run_reference=run_reference)
    except SpecError as e:
        raise click.ClickException(f"invalid spec:\n{e}")
    except ValueError as e:  # unknown name (lists the available ones)
        raise click.ClickException(str(e))


def _without_worker_traceback(message: str, verbose: bool) -> str:
    """A build failure's message less the build worker's traceback (kept with --verbose)."""
    head, sep, _ = message.partition("\nin the build worker:\n")
    return message if verbose or not sep else head + " (--verbose shows the build worker's traceback)"


def _all_specs():
    specs = []
    problems = []
    for path in list_specs():
        try:
            specs.append(load_spec(str(path)))
        except SpecError as e:
            problems.append(str(e))
    if problems:
        raise click.ClickException("invalid spec(s):\n" + "\n".join(problems))
    return specs


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tbegen", message="tbegen %(version)s")
def main():
    """Generate fused embedding-table training kernels (CUDA and CPU) from optimizer specs."""


@main.command("list")
def list_cmd():
    """List the available optimizers with their one-line summaries."""
    specs = _all_specs()
    width = max((len(s.name) for s in specs), default=0)
    for s in specs:
        click.echo(f"{s.name:<{width}}  {s.summary}")


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True, help="Treat warnings (integer division used as a float, a float stored "
                                             "in an int, unused declarations, ...) as errors.")
def validate(files, strict):
    """Check spec files; report every problem as FILE:LINE[:COL]: FIELD: MESSAGE.

    Validation never compiles a spec, but it runs its Python reference once on a tiny synthetic
    batch (3 rows, checking what it leaves in each state). Specs are code, like a Makefile or
    setup.py: `tbegen test` and the module compile their C++ snippets into a library that is
    loaded into the process, and `tbegen test` executes their Python reference. Validate, build
    and test only specs you trust.
    """
    failed = False
    for f in files:
        warnings = []
        try:
            load_spec(f, warnings, run_reference=True)
        except SpecError as e:
            failed = True
            for p in sorted(e.problems + tuple(warnings), key=lambda p: (p.line, p.col or 0)):
                click.echo(str(p), err=True)
        except OSError as e:
            failed = True
            click.echo(f"{f}:0: file: {e.strerror or e}", err=True)
        else:
            for p in warnings:
                click.echo(str(p), err=True)
            if strict and warnings:
                failed = True
                click.echo(f"{f}: {len(warnings)} warning(s), errors under --strict", err=True)
            else:
                click.echo(f"{f}: ok" + (f" ({len(warnings)} warning(s))" if warnings else ""))
    sys.exit(1 if failed else 0)


@main.command()
@click.option("--optimizer", "-o", "optimizers", multiple=True, help="Spec name in optimizers/ or a path to a YAML file.")
@click.option("--all", "all_", is_flag=True, help="Render every spec in optimizers/.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default: generated/ of the project).")
def render(optimizers, all_, out):
    """Write the kernel sources, host wrappers and Python module of optimizers."""
    if not optimizers and not all_:
        raise click.UsageError("give --optimizer NAME (repeatable) or --all")
    out = out or rnd.DEFAULT_OUT
    outside = []  # specs from outside optimizers/ rendered into generated/
    if all_:
        files = rnd.render_tree(_all_specs())
        result = rnd.write_files(files, out, prune=True)
        # and what tbegen rendered there from a spec outside optimizers/ (no MANIFEST lists it)
        stray = _stray_renders(out, files)
        for rel in stray:
            (out / rel).unlink()
        result.removed.extend(stray)
        _remove_emptied_folders(out, stray)
    else:
        files = rnd.render_static()
        shipped = {p.resolve() for p in list_specs()}
        for name in optimizers:
            files.update(rnd.render_spec(_load(name)))
            if find_spec(name).resolve() not in shipped:
                outside.append(_load(name).name)
        if out.resolve() == rnd.DEFAULT_OUT.resolve():
            files["MANIFEST"] = rnd.render_tree(_all_specs())["MANIFEST"]
        else:
            outside = []
        result = rnd.write_files(files, out)
    for rel in result.written:
        click.echo(f"wrote {out / rel}")
    for rel in result.removed:
        click.echo(f"removed {out / rel}")
    for name in outside:
        click.echo(f"note: {name}'s spec is not in optimizers/, so `tbegen check` counts {out / name}/ as stale; "
                   f"`tbegen render --all` removes it again (render elsewhere with --out DIR)", err=True)
    click.echo(f"{out}: {len(result.written)} file(s) written, {len(result.unchanged)} already up to date, "
               f"{len(result.removed)} stale file(s) removed")


def _stray_renders(out: Path, files) -> list:
    """Files under `out` that tbegen wrote (their first line says `@generated by tbegen`) but the
    render `files` does not make: the sources of a spec from outside optimizers/ or of a removed
    one. Nothing else in `out` counts."""
    stray = []
    if not out.is_dir():
        return stray
    for path in sorted(out.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(out).as_posix()
        if rel in files:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                first = f.readline()
        except (OSError, UnicodeDecodeError):
            continue
        if first.startswith(("// @generated by tbegen", "# @generated by tbegen")):
            stray.append(rel)
    return stray


def _remove_emptied_folders(out: Path, removed: list) -> None:
    """The folders of the `removed` files, where nothing is left in them (but byte code)."""
    folders = {(out / rel).parent for rel in removed}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        while folder != out and folder.is_dir():
            entries = list(folder.iterdir())
            caches = [e for e in entries if e.is_dir() and e.name == "__pycache__"
                      and all(c.is_file() and c.suffix == ".pyc" for c in e.iterdir())]
            if len(caches) != len(entries):
                break
            for cache in caches:
                for c in cache.iterdir():
                    c.unlink()
                cache.rmdir()
            folder.rmdir()
            folder = folder.parent


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory to compare (default: generated/ of the project).")
def check(out):
    """Re-render everything in memory and compare with generated/ (never writes)."""
    out = out or rnd.DEFAULT_OUT
    files = rnd.render_tree(_all_specs())
    diffs = rnd.diff_tree(files, out)
    if not diffs:
        click.echo(f"generated/ is up to date ({len(files)} files)")
        return
    for d in diffs:
        click.echo(d, nl=False)
    # `render --all` rewrites and removes what tbegen wrote; anything else there is the user's to delete
    foreign = sorted({p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
                     - set(files) - set(_stray_renders(out, files))) if out.is_dir() else []
    fix = "tbegen render --all" + ("" if out.resolve() == rnd.DEFAULT_OUT.resolve() else f" --out {out}") + (f", and delete {', '.join(str(out / f) for f in foreign)} (not written by tbegen)"
                                   if foreign else "")
    click.echo(f"\n{len(diffs)} file(s) differ from a fresh render. Fix: {fix}", err=True)
    sys.exit(1)


@main.command()
@click.option("--optimizer", "-o", required=True, help="Spec name in optimizers/ or a path to a YAML file.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--quick", is_flag=True, help="Only fp32 weights (a smaller library built for them).")
@click.option("--verbose", "-v", is_flag=True, help="Print every case and the compiler's output.")
def test(optimizer, device, quick, verbose):
    """Build one optimizer and check it against its spec's float64 reference.

    Specs are code, like a Makefile or setup.py: this compiles the spec's C++ snippets into a
    library, loads it into this process, and executes the spec's Python reference. Test only
    specs you trust.
    """
    from . import build_workers

    # (a build worker starts importing torch now, beside this process's own import: the build, if
    # one is needed, then starts about a second sooner; unused, it ends with this process)
    build_workers.prestart()
    spec = _load(optimizer, run_reference=True)
    import torch

    from . import build, harness

    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is available here")
    t0 = time.perf_counter()
    from .compile_errors import CompileError

    try:
        # (--quick: a library of its own whose backward, CPU and CUDA, takes float32 weights only,
        # a third of the full library's compile; the full one is built by `tbegen test` and the module)
        ops = build.load_ops(spec, with_cuda=(device == "cuda"), verbose=verbose, fp32_weights_only=quick)
    except CompileError as e:  # already in the spec's terms, with the log's path: no traceback
        raise click.ClickException(str(e))
    except RuntimeError as e:  # a build that failed otherwise (tbegen's own words)
        raise click.ClickException(_without_worker_traceback(str(e), verbose))
    click.echo(f"{spec.name}: extension ready in {time.perf_counter() - t0:.1f} s")

    def checked(run, case):
        """run(case), with what goes wrong said in the spec's terms and no traceback (unless
        --verbose asks for one, for what is not the spec's fault)."""
        try:
            return run(case)
        except harness.ReferenceFailure as e:
            raise click.ClickException(f"the spec's reference failed (case {case.id}):\n{e}")
        except Exception as e:  # noqa: BLE001
            if verbose:
                import traceback

                traceback.print_exc()
            raise click.ClickException(f"checking {spec.name} failed in case {case.id}: {type(e).__name__}: {e}"
                                       + ("" if verbose else " (--verbose shows where)"))
    dtypes = (torch.float32,) if quick else (torch.float32, torch.float16, torch.bfloat16)
    cases = harness.standard_cases(spec, dtypes=dtypes)
    results = []
    t0 = time.perf_counter()
    with click.progressbar(cases, label=f"checking {spec.name} on {device}", show_pos=True,
                           file=sys.stderr) as bar:
        for case in bar:
            r = checked(lambda c: harness.run_case(spec, ops, c, device=device), case)
            results.append(r)
            if verbose:
                click.echo(f"  {case.id}: worst {r.worst:.3g}" + (" FAILED" if r.failures else ""), err=True)
    click.echo(harness.summarize(results))
    if device == "cpu":
        # the same cases run the way the GPU splits rows over lanes: what passes here passes there
        results += [checked(lambda c: harness.run_lane_split_case(spec, ops, c), case) for case in cases]
        click.echo(harness.summarize_lane_split(results[len(cases):]))
    click.echo(f"checked in {time.perf_counter() - t0:.1f} s")
    sys.exit(1 if any(r.failures for r in results) else 0)



@main.command()
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the schema to this file instead of printing it.")
def schema(out):
    """Print the JSON Schema (draft 2020-12) of the spec format, for editors."""
    from .schema import schema_json

    if out is None:
        click.echo(schema_json(), nl=False)
    else:
        out.write_text(schema_json())
        click.echo(f"wrote {out}")



@main.command()
@click.argument("name")
@click.option("--from", "from_spec", default=None, help="Start from this spec (a name in optimizers/ or a path).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
              help="Folder to write NAME.yaml into.")
def new(name, from_spec, out):
    """Write a new spec NAME.yaml that validates and passes `tbegen test`, to edit from there."""
    from .scaffold import write_scaffold

    try:
        path = write_scaffold(name, out, from_spec)
    except SpecError as e:
        raise click.ClickException(f"cannot scaffold {name!r}:\n{e}")
    except (ValueError, FileExistsError) as e:
        raise click.ClickException(str(e))
    click.echo(f"wrote {path}")
    click.echo(f"next: tbegen validate {path} && tbegen test --optimizer {path} --quick")


if __name__ == "__main__":
    main()

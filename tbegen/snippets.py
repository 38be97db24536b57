"""The snippet checker: every mistake in a spec's update stages and reference that can be found
without a compiler, each at its exact line and column.

`tbegen.spec` runs it on every spec it loads (so `tbegen validate`, `tbegen test`, rendering and
building all see its findings before any compiler runs). It works on tokens, not on a full C++
parse: the snippet language is small (docs/spec-language.md) and this module is its definition.
Every identifier must resolve to something the language allows: a hyperparameter, a state, a
temporary, a name the generator binds (g, w, step, D), a local of an earlier row stage or of the
stage itself, a row reduction, or an entry of the allow-lists below. Whatever is not on them is an
error, so nothing outside the language (the generator's own `tbegen_row`, CUDA built-ins, `static`
variables, pointers, preprocessor tricks) reaches the compiler.

One spec, one meaning (issue 14). The CPU kernel runs a row's element stage as one loop over the
row; the CUDA kernel gives each of a warp's 32 lanes its own slices of the row and its own copy of
every per-row state and row-stage local (templates/include/tbegen/cuda_kernels.cuh, WarpRow). Both
give the same result exactly when nothing an element stage does can reach another element. So the
checker rejects, in element stages, every way one element could influence another:

- assigning (=, +=, ++, ...) a per-row state or a local of an earlier row stage: each lane would
  update its own copy from its own slice, and one copy is kept (the CPU sums the whole row);
- `return`, `break`, `continue`, `goto`, `switch`: a row-wide exit on the CPU, one lane's on the GPU;
- `static` (and any storage other than an initialised local), pointers, references and addresses,
  arrays and subscripts: ways to keep or reach a value across elements;
- a local declared without a value: it may hold the previous element's value;
- a temporary read before an element stage sets it unconditionally: the GPU starts it at 0, the
  CPU's scratch holds the previous row's values;
- assignments inside a row reduction's argument (that argument is evaluated per element).

Reading `g`/`w`/element states/temporaries of *other* elements is impossible in the language (the
element is implicit), and loops over elements cannot be written (the row view is not nameable).
What remains device-dependent is rounding (the order of a reduction's sum, contraction into
fused multiply-adds, the accuracy of math functions) and undefined behaviour such as converting an
out-of-range float to an int; the CPU harness's lane-split mode (tbegen/harness.py) is the second
line of defence.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .model import ROW_REDUCTIONS
from .vocabulary import CPP_KEYWORDS

# ---- the language's vocabulary -----------------------------------------------------------------

BOUND_NAMES = {
    "g": "the gradient element",
    "w": "the weight element",
    "step": "the step counter",
    "D": "the row width",
    "col": "the element's column, 0 to D - 1 (whole-table stages)",
}
READ_ONLY_BOUND = {"g", "step", "D", "col"}
ELEMENT_BOUND = {"g", "w"}

# Math functions available, with the same meaning, in host C++ (<cmath>) and CUDA device code.
# (Not `abs`, `min`, `max`: on the host they are integer functions or missing; use fabsf, fminf,
# fmaxf. Not `rsqrtf`, `__expf` & co.: CUDA only.)
MATH_FUNCTIONS = frozenset(
    """
    sqrtf sqrt cbrtf cbrt powf pow expf exp exp2f exp2 expm1f expm1 logf log log2f log2 log10f log10
    log1pf log1p fabsf fabs fmaxf fmax fminf fmin copysignf copysign floorf floor ceilf ceil roundf
    round truncf trunc fmodf fmod tanhf tanh sinf sin cosf cos tanf tan atanf atan atan2f atan2
    erff erf erfcf erfc hypotf hypot fmaf fma
    """.split()
)
CONSTANTS = frozenset({"INFINITY", "NAN"})
TYPE_WORDS = frozenset({"float", "double", "int", "bool", "long", "unsigned", "auto", "const",
                        "int64_t", "int32_t", "uint32_t", "uint64_t"})
CONTROL_WORDS = frozenset({"if", "else", "for", "while", "do"})
OTHER_WORDS = frozenset({"true", "false", "static_cast"})
# Keywords with a reason of their own; every other C++ keyword is "not part of the language".
KEYWORD_REASONS = {
    "return": "ends the whole row's update on the CPU but only one lane's share on the GPU; put the "
              "rest of the stage under an `if`",
    "break": "would end the loop over the row's elements (the whole row on the CPU, one lane's share "
             "on the GPU); use an `if`",
    "continue": "is not part of the snippet language; use an `if`",
    "goto": "is not part of the snippet language",
    "switch": "is not part of the snippet language; use if/else",
    "static": "variables keep their value across elements and rows (on the CPU; the GPU has no such "
              "thing); carry values between stages with temporaries or row-stage locals",
    "thread_local": "variables are not part of the snippet language",
    "extern": "is not part of the snippet language",
    "volatile": "is not part of the snippet language",
}

ASSIGN_OPS = frozenset({"=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="})
INCREMENT_OPS = frozenset({"++", "--"})

_TOKEN_RE = re.compile(
    r"""
    (?P<nl>\n)
  | (?P<ws>[ \t\r\f\v]+)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<open_comment>/\*)
  | (?P<number>0[xX][0-9a-fA-F]+[uUlL]*|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?[fFlLuU]*)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?)
  | (?P<op><<=|>>=|::|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|[-+*/%&|^!~<>=?:;,.(){}\[\]\#])
  | (?P<other>.)
    """,
    re.X | re.S,
)

_OPENERS = {"(": ")", "{": "}", "[": "]"}
_CLOSERS = {v: k for k, v in _OPENERS.items()}


# ---- inputs and findings -----------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    line: int  # 1-based line in the spec file
    col: int  # 1-based column in the spec file
    field: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class Source:
    """A piece of code from the YAML file and where each of its lines starts there."""

    code: str
    field: str
    # per line of `code`: (1-based file line, 0-based file column of the code line's first character)
    starts: Tuple[Tuple[int, int], ...]

    def at(self, line_index: int, col_index: int) -> Tuple[int, int]:
        if line_index < len(self.starts):
            file_line, offset = self.starts[line_index]
        else:  # past the recorded lines (a folded scalar): the last known line
            file_line, offset = self.starts[-1] if self.starts else (1, 0)
            file_line += line_index - (len(self.starts) - 1)
        return file_line, offset + col_index + 1


@dataclass(frozen=True)
class StageSource:
    kind: str  # "row" | "element" | "table" (a whole-table stage's element code) | "reduce" (a reduce stage's `of:`)
    source: Source
    when: Optional[Source] = None  # the stage's guard (a condition over hyperparameters)


@dataclass
class Declared:
    """The names a spec declares, with where (line, col of the key) for warnings."""

    hyperparameters: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    # name -> ("row" | "element" | None when the `per` is itself wrong, (line, col))
    states: Dict[str, Tuple[Optional[str], Tuple[int, int]]] = field(default_factory=dict)
    temporaries: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    def row_states(self) -> Set[str]:
        return {n for n, (per, _) in self.states.items() if per == "row"}

    def table_states(self) -> Set[str]:
        return {n for n, (per, _) in self.states.items() if per == "table"}

    def element_values(self) -> Set[str]:
        """Names with one value per element: g, w, element states and temporaries."""
        return set(ELEMENT_BOUND) | {n for n, (per, _) in self.states.items() if per == "element"} | set(self.temporaries)


@dataclass
class _Token:
    kind: str  # name | number | op | string | other
    text: str
    line: int  # 0-based line in the snippet
    col: int  # 0-based column in the snippet line
    end_line: int
    end_col: int  # column just after the token


def tokenize(code: str) -> Tuple[List[_Token], List[Tuple[int, int, str]]]:
    """Tokens (without spaces and comments) and lexical problems (line, col, message)."""
    tokens: List[_Token] = []
    problems: List[Tuple[int, int, str]] = []
    line, line_start = 0, 0
    skip_line = -1  # a preprocessor line: reported once, its tokens dropped
    for m in _TOKEN_RE.finditer(code):
        kind = m.lastgroup
        text = m.group(0)
        col = m.start() - line_start
        if kind == "open_comment":
            problems.append((line, col, "unterminated /* comment"))
            break
        if kind == "op" and text == "#":
            problems.append((line, col, "preprocessor directives are not part of the snippet language (a snippet "
                                        "means the same on every device)"))
            skip_line = line
        elif kind not in ("nl", "ws", "comment") and skip_line != line:
            end_line = line + text.count("\n")
            end_col = len(text) - text.rfind("\n") - 1 if "\n" in text else col + len(text)
            tokens.append(_Token(kind, text, line, col, end_line, end_col))
        if "\n" in text:
            line += text.count("\n")
            line_start = m.start() + text.rfind("\n") + 1
    return tokens, problems


# Functions people reach for that mean different things on the host and in CUDA, or exist on one only.
_FUNCTION_HINTS = {"max": "fmaxf", "min": "fminf", "abs": "fabsf", "rsqrtf": "sqrtf", "__expf": "expf"}


def _suggest(name: str, candidates) -> str:
    if name in _FUNCTION_HINTS:
        return f" (did you mean {_FUNCTION_HINTS[name]!r}? {name!r} is not the same function on the CPU and the GPU)"
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- the stage checker -----------------------------------------------------------------------


class _StageChecker:
    """Checks one stage; `row_locals` carries the top-level locals of earlier row stages."""

    def __init__(self, stage: StageSource, declared: Declared, row_locals: Dict[str, Tuple[int, int]],
                 set_temporaries: Set[str], findings: List[Finding], used: Set[str]):
        self.kind = stage.kind
        self.src = stage.source
        self.declared = declared
        self.row_locals = row_locals
        self.set_temporaries = set_temporaries
        self.findings = findings
        self.used = used
        self.tokens: List[_Token] = []
        self.match: Dict[int, int] = {}  # bracket index -> its partner
        self.paren_kind: Dict[int, str] = {}  # index of ')' -> control | cast | call | group
        self.declared_at: Set[int] = set()  # token indices of names being declared
        self.init_eq: Set[int] = set()  # token indices of a declaration's '='
        self.reduction_spans: List[Tuple[int, int]] = []  # (open paren, close paren) of reductions

    # -- reporting
    def error(self, tok: _Token, message: str, after: bool = False) -> None:
        line, col = (tok.end_line, tok.end_col) if after else (tok.line, tok.col)
        file_line, file_col = self.src.at(line, col)
        self.findings.append(Finding(file_line, file_col, self.src.field, message))

    # -- helpers
    def _is_name(self, i: int) -> bool:
        return 0 <= i < len(self.tokens) and self.tokens[i].kind == "name"

    def _text(self, i: int) -> str:
        return self.tokens[i].text if 0 <= i < len(self.tokens) else ""

    def _ends_operand(self, i: int) -> bool:
        """Whether token i can end an expression (so that what follows is a binary operator)."""
        if i < 0:
            return False
        t = self.tokens[i]
        if t.kind == "number":
            return True
        if t.kind == "name":
            return t.text not in TYPE_WORDS and t.text not in CONTROL_WORDS and t.text not in KEYWORD_REASONS \
                and t.text != "static_cast"
        if t.text in (")", "]"):
            return self.paren_kind.get(i) not in ("control", "cast")
        if t.text in INCREMENT_OPS:
            return self._ends_operand(i - 1) or self._text(i - 1) in (")", "]")
        return False

    def _in_reduction(self, i: int) -> bool:
        return any(a < i < b for a, b in self.reduction_spans)

    def _group_names(self, a: int, b: int) -> List[int]:
        """Names inside the brackets a..b; of a conditional `(c ? x : y)`, those of its branches."""
        depth, start = 0, a + 1
        for k in range(a + 1, b):
            x = self._text(k)
            depth += 1 if x in _OPENERS else -1 if x in _CLOSERS else 0
            if depth == 0 and x == "?":
                start = k + 1
                break
        return [k for k in range(start, b) if self._is_name(k)]

    def _lvalue_names(self, j: int) -> List[int]:
        """Token indices of the names in the left operand of the assignment operator at j."""
        names = []
        k = j - 1
        while k >= 0:
            t = self.tokens[k]
            if t.text == ")" and k in self.match:
                o = self.match[k]
                if self.paren_kind.get(k) == "control":
                    break
                names += self._group_names(o, k)
                k = o - 1
                continue
            if t.kind == "op" and (t.text in (";", "{", "}", ",", "(", "?", ":") or t.text in ASSIGN_OPS):
                break
            if t.kind == "name" and (t.text in TYPE_WORDS or t.text in CONTROL_WORDS or t.text in KEYWORD_REASONS):
                break
            if t.kind == "name":
                names.append(k)
                if self._ends_operand(k - 1):
                    break  # a missing ';' before this name (reported by _statements)
            k -= 1
        return names

    def _increment_names(self, j: int) -> List[int]:
        """Token indices of the names in the operand of the ++/-- at j."""
        if self._ends_operand(j - 1) and self._text(j - 1) not in INCREMENT_OPS:
            k = j - 1  # postfix
            if self._text(k) == ")" and k in self.match:
                return self._group_names(self.match[k], k)
            return [k] if self._is_name(k) else []
        k = j + 1  # prefix
        if self._text(k) == "(" and k in self.match:
            return self._group_names(k, self.match[k])
        return [k] if self._is_name(k) else []

    # -- passes
    def run(self) -> None:
        self.tokens, lexical = tokenize(self.src.code)
        for line, col, message in lexical:
            file_line, file_col = self.src.at(line, col)
            self.findings.append(Finding(file_line, file_col, self.src.field, message))
        balanced = self._brackets()
        if balanced:
            self._classify_parens()
        self._lexicon()
        self._declarations()
        if not balanced or lexical:
            self._names(structure=False)
            return
        self._reductions()
        self._names(structure=True)
        self._statements()
        self._assignments()
        if self.kind != "table":
            self._temporaries()

    def _brackets(self) -> bool:
        stack: List[int] = []
        ok = True
        for i, t in enumerate(self.tokens):
            if t.kind != "op":
                continue
            if t.text in _OPENERS:
                stack.append(i)
            elif t.text in _CLOSERS:
                if stack and self.tokens[stack[-1]].text == _CLOSERS[t.text]:
                    o = stack.pop()
                    self.match[o], self.match[i] = i, o
                else:
                    expected = f", expected {_OPENERS[self.tokens[stack[-1]].text]!r}" if stack else ""
                    self.error(t, f"unbalanced brackets: {t.text!r} closes nothing{expected}")
                    ok = False
        for o in stack:
            self.error(self.tokens[o], f"unbalanced brackets: {self.tokens[o].text!r} is never closed "
                                       f"(missing {_OPENERS[self.tokens[o].text]!r})")
            ok = False
        return ok

    def _lexicon(self) -> None:
        """Tokens that are never part of the language."""
        for i, t in enumerate(self.tokens):
            if t.kind == "string":
                self.error(t, "string and character literals are not part of the snippet language")
            elif t.kind == "other":
                self.error(t, f"unexpected character {t.text!r}")
            elif t.kind == "op" and t.text in ("::", "->", "."):
                self.error(t, f"{t.text!r}: qualified names and members are not part of the snippet language")
            elif t.kind == "op" and t.text == "[":
                self.error(t, "arrays, subscripts and lambdas are not part of the snippet language")
            elif t.kind == "op" and t.text == "&" and not self._ends_operand(i - 1):
                self.error(t, "addresses and references are not part of the snippet language")
            elif t.kind == "op" and t.text == "*" and self._text(i - 1) in TYPE_WORDS:
                self.error(t, "pointers are not part of the snippet language")

    def _classify_parens(self) -> None:
        for i, t in enumerate(self.tokens):
            if t.text != ")" or i not in self.match:
                continue
            o = self.match[i]
            before = self._text(o - 1)
            inside = [self.tokens[k].text for k in range(o + 1, i)]
            if before in ("if", "while", "for", "switch"):
                self.paren_kind[i] = "control"
            elif inside and all(x in TYPE_WORDS for x in inside):
                self.paren_kind[i] = "cast"
            elif self._is_name(o - 1) and before not in TYPE_WORDS:
                self.paren_kind[i] = "call"
            else:
                self.paren_kind[i] = "group"

    def _declarations(self) -> None:
        """Marks declared names; reports declarations without a value."""
        n = len(self.tokens)
        i = 0
        while i < n:
            t = self.tokens[i]
            if not (t.kind == "name" and t.text in TYPE_WORDS) or self._text(i - 1) in TYPE_WORDS or \
                    self._text(i - 1) == "<":
                i += 1
                continue
            k = i
            while k < n and (self._text(k) in TYPE_WORDS or (k > i and self._text(k) in ("*", "&"))):
                k += 1  # (a pointer or reference is reported by _lexicon; its name is still declared)
            if not self._is_name(k) or self._text(k) in KEYWORD_REASONS or self._text(k) in CONTROL_WORDS:
                i = k
                continue
            # one or more declarators: NAME = EXPR, NAME = EXPR ...
            while self._is_name(k):
                self.declared_at.add(k)
                if self._text(k + 1) != "=":
                    self.error(self.tokens[k], f"declare {self._text(k)!r} with a value "
                                               f"(`{self._text(i)} {self._text(k)} = ...;`): a local without "
                                               f"one may hold another element's value")
                    k += 1
                else:
                    self.init_eq.add(k + 1)
                    k += 2
                    depth = 0
                    while k < n:  # skip the initializer to a ',' or ';' at this depth
                        x = self._text(k)
                        if x in _OPENERS:
                            depth += 1
                        elif x in _CLOSERS:
                            if depth == 0:
                                break
                            depth -= 1
                        elif depth == 0 and x in (",", ";"):
                            break
                        k += 1
                if self._text(k) == ",":
                    k += 1
                    continue
                break
            i = k

    def _reductions(self) -> None:
        for i, t in enumerate(self.tokens):
            if t.kind != "name" or t.text not in ROW_REDUCTIONS:
                continue
            if self.kind in ("element", "table"):
                where = " (of `update`), not in a whole-table stage" if self.kind == "table" else ""
                self.error(t, f"{t.text}(...) is a row reduction; use it in a row stage only{where}")
                continue
            if self._text(i + 1) != "(":
                self.error(t, f"{t.text} is a row reduction: call it as {t.text}(EXPR)")
                continue
            close = self.match[i + 1]
            if self._in_reduction(i):
                self.error(t, f"{t.text}(...) is nested in another row reduction")
                continue
            self.reduction_spans.append((i + 1, close))

    def _names(self, structure: bool) -> None:
        """Resolves every identifier (scope-aware for the stage's own locals)."""
        decl = self.declared
        spec_names = set(decl.hyperparameters) | set(decl.states) | set(decl.temporaries)
        element_values = decl.element_values()
        scopes: List[Dict[str, Tuple[int, int]]] = [{}]
        for i, t in enumerate(self.tokens):
            if t.kind == "op" and structure:
                if t.text == "{":
                    scopes.append({})
                elif t.text == "}" and len(scopes) > 1:
                    scopes.pop()
                continue
            if t.kind != "name":
                continue
            name = t.text
            if name in TYPE_WORDS or name in CONTROL_WORDS or name in OTHER_WORDS:
                continue
            if name in KEYWORD_REASONS:
                self.error(t, f"{name!r} {KEYWORD_REASONS[name]}")
                continue
            if _is_cpp_keyword(name):
                self.error(t, f"{name!r} is not part of the snippet language")
                continue
            if i in self.declared_at:
                where = self._already(name, scopes)
                if where:
                    self.error(t, f"{name!r} is already declared {where}; choose another name")
                else:
                    scopes[-1][name] = (t.line, t.col)
                    if self.kind == "row" and len(scopes) == 1 and self._paren_depth(i) == 0:
                        self.row_locals[name] = self.src.at(t.line, t.col)
                continue
            if name in ROW_REDUCTIONS:
                continue
            if self._text(i - 1) in (".", "->", "::") or self._text(i + 1) == "::":
                continue  # reported as not part of the language
            if any(name in s for s in scopes) or name in self.row_locals:
                self.used.add(name)
                continue
            if name == "partner":
                self._partner(i)
                continue
            if self.kind == "table" and self._is_partner_argument(i):
                self.used.add(name)
                continue  # checked by _partner
            if self.kind == "table":
                if name == "g":
                    self.error(t, "'g': a whole-table stage has no gradient (it runs over every row before the "
                                  "step's forward); read `w` and the states")
                    continue
                if name in decl.temporaries:
                    self.error(t, f"{name!r} is a temporary: temporaries carry values between the stages of "
                                  f"`update`; a whole-table stage uses locals")
                    continue
                if name in decl.table_states():
                    self.error(t, f"{name!r} is a per-table state: whole-table element stages do not read "
                                  f"per-table states (the `update` stages and the `of:` of reduce stages do)")
                    continue
            elif name == "col":
                self.error(t, "'col' (the element's column) is bound in whole-table stages (`table:`) only")
                continue
            self.used.add(name)
            if name in element_values:
                if self.kind == "row" and not self._in_reduction(i) and structure:
                    self.error(t, f"{name!r} has one value per element; in a row stage use it only inside a "
                                  f"row reduction (row_sum, row_mean, row_max, row_min)")
                continue
            if name in spec_names or name in BOUND_NAMES or name in CONSTANTS:
                continue
            if name in MATH_FUNCTIONS:
                if self._text(i + 1) != "(":
                    self.error(t, f"{name!r} is a function: call it")
                continue
            if name.startswith("tbegen"):
                self.error(t, f"{name!r}: names starting with 'tbegen' belong to the generator")
                continue
            if self._text(i + 1) == "(":
                self.error(t, f"unknown function {name!r}{_suggest(name, MATH_FUNCTIONS | set(ROW_REDUCTIONS))}")
                continue
            visible = set(spec_names) | set(BOUND_NAMES) | set(self.row_locals) | CONSTANTS
            for s in scopes:
                visible |= set(s)
            self.error(t, f"unknown name {name!r}{_suggest(name, visible)}")

    def _is_partner_argument(self, i: int) -> bool:
        return self._text(i - 1) == "(" and self._text(i - 2) == "partner"

    def _partner(self, i: int) -> None:
        """`partner(X)`: X at the element paired with this one (whole-table stages only)."""
        t = self.tokens[i]
        if self.kind != "table":
            self.error(t, "partner(...) reads the paired element of the row; it exists in whole-table stages "
                          "(`table:`) only")
            return
        if self._text(i + 1) != "(" or self._text(i + 3) != ")":
            self.error(t, "call partner with one name: partner(w) or partner(STATE) for a per-element state")
            return
        arg = self.tokens[i + 2]
        element_states = {n for n, (per, _) in self.declared.states.items() if per == "element"}
        if arg.kind == "name" and (arg.text == "w" or arg.text in element_states):
            return
        self.error(arg, f"partner({arg.text}): only `w` and per-element states have a partner element"
                        + (" (temporaries exist in `update` stages only)" if arg.text in self.declared.temporaries
                           else ""))

    def _paren_depth(self, i: int) -> int:
        depth = 0
        for k in range(i):
            x = self._text(k)
            if x == "(":
                depth += 1
            elif x == ")":
                depth -= 1
        return depth

    def _already(self, name: str, scopes) -> str:
        decl = self.declared
        if name in decl.hyperparameters:
            return "as a hyperparameter"
        if name in decl.states:
            return "as a state"
        if name in decl.temporaries:
            return "as a temporary"
        if name in BOUND_NAMES:
            return f"by the generator ({BOUND_NAMES[name]})"
        if name in MATH_FUNCTIONS or name in CONSTANTS or name in ROW_REDUCTIONS or name == "partner":
            return "as a function or constant of the language"
        if name.startswith("tbegen") or name.startswith("_"):
            return "by the generator (names starting with 'tbegen' or '_' are reserved)"
        for s in scopes:
            if name in s:
                line, _ = self.src.at(*s[name])
                return f"at line {line}"
        if name in self.row_locals:
            return f"in an earlier row stage (line {self.row_locals[name][0]})"
        return ""

    def _statements(self) -> None:
        """A statement without its ';' shows as two operands in a row."""
        toks = self.tokens
        for i in range(1, len(toks)):
            t = toks[i]
            if t.kind not in ("name", "number") or t.text in OTHER_WORDS - {"true", "false"}:
                continue
            if t.text in ("else",) or not self._ends_operand(i - 1):
                continue
            prev = toks[i - 1]
            if prev.end_line != t.line:
                self.error(prev, "missing ';' at the end of this statement", after=True)
            else:
                self.error(t, f"expected an operator or ';' before {t.text!r}")
        if toks and toks[-1].text not in (";", "}"):
            self.error(toks[-1], "missing ';' at the end of this statement", after=True)

    def _assignments(self) -> None:
        decl = self.declared
        row_states = decl.row_states()
        assigned_before: Dict[str, int] = {}  # name -> first token index where it is set
        for i in self.declared_at:
            assigned_before.setdefault(self._text(i), i)
        for j, t in enumerate(self.tokens):
            if t.kind != "op":
                continue
            if t.text in ASSIGN_OPS and j not in self.init_eq:
                targets = self._lvalue_names(j)
            elif t.text in INCREMENT_OPS:
                targets = self._increment_names(j)
            else:
                continue
            if self._in_reduction(j):
                self.error(t, f"{t.text!r} in a row reduction's argument: the argument is evaluated once per "
                              f"element and may not assign anything")
                continue
            for k in targets:
                name = self._text(k)
                assigned_before.setdefault(name, k)
                tok = self.tokens[k]
                if name == "partner":
                    self.error(tok, "partner(...) is read-only: a whole-table stage writes its own element only")
                elif self.kind == "table" and name in row_states:
                    self.error(tok, f"{name!r} is a per-row state: a whole-table stage reads it but may not "
                                    f"assign it (the stage runs once per element)")
                elif name in decl.table_states():
                    self.error(tok, f"{name!r} is a per-table state: read-only here (a constant during the "
                                    f"step); a `reduce` stage of `table:` sets it, before the step's forward")
                elif name in decl.hyperparameters:
                    self.error(tok, f"{name!r} is a hyperparameter: read-only")
                elif name in READ_ONLY_BOUND:
                    self.error(tok, f"{name!r} is read-only ({BOUND_NAMES[name]})")
                elif self.kind == "element" and name in row_states:
                    self.error(tok, f"{name!r} is a per-row state: an element stage may not assign it (on the "
                                    f"GPU each lane would update its own copy from its slice of the row); "
                                    f"accumulate it with row_sum in a row stage: `{name} += row_sum(...);`")
                elif self.kind == "element" and name in self.row_locals and not self._local_here(k):
                    self.error(tok, f"{name!r} is a local of an earlier row stage: an element stage may not "
                                    f"assign it (on the GPU each lane would update its own copy from its slice "
                                    f"of the row); compute it with a row reduction (row_sum, ...) in a row stage")
        # Reductions are computed before the stage's statements run (docs/spec-language.md).
        for a, b in self.reduction_spans:
            used = {self._text(k) for k in range(a + 1, b) if self._is_name(k)}
            clash = sorted(n for n in used if n in assigned_before and assigned_before[n] < a)
            if clash:
                red = self.tokens[a - 1]
                self.error(red, f"{red.text}(...) uses {', '.join(repr(n) for n in clash)}, which this stage sets "
                                f"before it; reductions see the values from before the stage, so move the "
                                f"reduction into a new row stage after this one")

    def _local_here(self, k: int) -> bool:
        """Whether the name at k refers to a local this stage declared before k (shadowing is an
        error of its own, so a declaration anywhere before counts)."""
        name = self._text(k)
        return any(self._text(i) == name and i < k for i in self.declared_at)

    def _temporaries(self) -> None:
        """A temporary must be set by an unconditional `t = ...;` in an element stage before any read."""
        temps = set(self.declared.temporaries)
        reported: Set[str] = set()
        for i, t in enumerate(self.tokens):
            name = t.text
            if t.kind != "name" or name not in temps or name in self.set_temporaries or name in reported:
                continue
            if self.kind == "element" and self._unconditional_set(i):
                self.set_temporaries.add(name)
                continue
            reported.add(name)
            self.error(t, f"temporary {name!r} is read before an element stage sets it: start with an "
                          f"unconditional `{name} = ...;` at the top level of an element stage (its value "
                          f"before that differs between the CPU and the GPU)")

    def _unconditional_set(self, i: int) -> bool:
        if self._text(i + 1) != "=" or self._paren_depth(i) != 0:
            return False
        if i > 0 and self._text(i - 1) not in (";", "}"):
            return False
        depth = 0
        for k in range(i):
            depth += {"{": 1, "}": -1}.get(self._text(k), 0)
        if depth != 0:
            return False
        k = i + 2
        while k < len(self.tokens) and self._text(k) != ";":
            if self._text(k) == self._text(i):
                return False
            k += 1
        return True


def _is_cpp_keyword(name: str) -> bool:
    return name in CPP_KEYWORDS


# What a `when:` guard may contain besides hyperparameters and the step: it is evaluated once per
# row, the same on every lane of a warp and in every kernel, so it may not read anything that
# varies by row or element (no states, no g/w, no D, no locals).
GUARD_OPS = frozenset({"(", ")", "<", ">", "<=", ">=", "==", "!=", "&&", "||", "!", "+", "-", "*", "/", "%", "?",
                       ":"})


def check_guard(source: Source, declared: Declared, used: Set[str], table: bool = False) -> List[Finding]:
    """A stage's `when:` condition: hyperparameters, `step`, numbers, true/false and operators only.
    `table`: a whole-table stage's guard (evaluated once per step, on the host)."""
    decides = ("once per step, on the host, whether the whole-table stage runs" if table else
               "once per row and the same on every lane, whether the stage runs")
    findings: List[Finding] = []
    tokens, bad = tokenize(source.code)
    for line, col, text in bad:
        file_line, file_col = source.at(line, col)
        findings.append(Finding(file_line, file_col, source.field, f"unexpected character {text!r}"))
    for t in tokens:
        file_line, file_col = source.at(t.line, t.col)
        if t.kind == "name":
            if t.text in declared.hyperparameters:
                used.add(t.text)
            elif t.text not in ("true", "false", "step"):
                findings.append(Finding(
                    file_line, file_col, source.field,
                    f"{t.text!r}: a guard may read hyperparameters and `step` only (it decides, {decides})"
                    f"{_suggest(t.text, declared.hyperparameters)}"))
        elif t.kind == "number":
            continue
        elif t.kind != "op" or t.text not in GUARD_OPS:
            findings.append(Finding(file_line, file_col, source.field, f"{t.text!r} is not allowed in a guard"))
    return findings


def check_stages(stages: Sequence[StageSource], declared: Declared) -> List[Finding]:
    """Every problem in the update stages, in stage order, plus unused-declaration warnings."""
    findings: List[Finding] = []
    row_locals: Dict[str, Tuple[int, int]] = {}
    set_temporaries: Set[str] = set()
    used: Set[str] = set()
    guard: Optional[str] = None  # the current run of stages' guard (None: unguarded)
    before_guard: Dict[str, Tuple[int, int]] = {}
    for stage in stages:
        if stage.kind == "reduce":
            if stage.when is not None:
                findings.extend(check_guard(stage.when, declared, used, table=True))
            findings.extend(check_reduce_expression(stage.source, declared, used))
            continue
        if stage.kind == "table":
            # a whole-table stage stands alone: its own guard, no locals of other stages
            if stage.when is not None:
                findings.extend(check_guard(stage.when, declared, used, table=True))
            _StageChecker(stage, declared, {}, set(), findings, used).run()
            continue
        when = stage.when.code if stage.when is not None else None
        if when != guard:
            # a guarded run's locals end with it (the generated code closes its `if` there)
            if guard is not None:
                row_locals.clear()
                row_locals.update(before_guard)
            before_guard = dict(row_locals)
            guard = when
            if stage.when is not None:
                findings.extend(check_guard(stage.when, declared, used))
        _StageChecker(stage, declared, row_locals, set_temporaries, findings, used).run()
    if stages:
        for name, (line, col) in declared.hyperparameters.items():
            if name not in used:
                findings.append(Finding(line, col, f"hyperparameters.{name}",
                                        f"{name!r} is never used in the update stages", warning=True))
        for name, (_, (line, col)) in declared.states.items():
            if name not in used:
                findings.append(Finding(line, col, f"states.{name}",
                                        f"{name!r} is never used in the update stages", warning=True))
    return findings


def check_reduce_expression(source: Source, declared: Declared, used: Set[str]) -> List[Finding]:
    """The `of:` of a reduce stage of `table:`: one C expression, evaluated once per row of a table,
    over per-row states, per-table states (their values before the stage), hyperparameters, `step`,
    `D`, numbers, the math functions and casts; it assigns nothing."""
    findings: List[Finding] = []

    def error(t: _Token, message: str) -> None:
        line, col = source.at(t.line, t.col)
        findings.append(Finding(line, col, source.field, message))

    tokens, bad = tokenize(source.code)
    for line, col, text in bad:
        file_line, file_col = source.at(line, col)
        findings.append(Finding(file_line, file_col, source.field, text))
    row_values = declared.row_states() | declared.table_states()
    element_values = declared.element_values()
    reads = "per-row and per-table states, hyperparameters, step and D"
    opened: List[int] = []  # indices of the open parentheses
    cast_close: Set[int] = set()  # ')' closing a C-style cast: an operand may follow it
    for i, t in enumerate(tokens):
        prev = tokens[i - 1] if i > 0 else None
        ends_operand = prev is not None and (prev.kind in ("name", "number") or (prev.text == ")" and i - 1 not in cast_close))
        if prev is not None and prev.kind == "name" and prev.text in TYPE_WORDS | {"static_cast"}:
            ends_operand = False
        if t.kind == "string":
            error(t, "string and character literals are not part of the snippet language")
        elif t.kind == "other":
            error(t, f"unexpected character {t.text!r}")
        elif t.kind == "op":
            if t.text in ASSIGN_OPS or t.text in INCREMENT_OPS:
                error(t, f"{t.text!r}: `of:` is an expression evaluated once per row; it may not assign anything")
            elif t.text in (";", "{", "}"):
                error(t, f"{t.text!r}: `of:` is one C expression, not statements")
            elif t.text in ("[", "]", "::", "->", ".", "#"):
                error(t, f"{t.text!r} is not part of the snippet language")
            elif t.text == "(":
                if ends_operand and not (prev is not None and prev.kind == "name"):
                    error(t, "expected an operator before '('")
                opened.append(i)
            elif t.text == ")":
                if not opened:
                    error(t, "unbalanced brackets: ')' closes nothing")
                else:
                    o = opened.pop()
                    inside = [x.text for x in tokens[o + 1 : i]]
                    if inside and all(x in TYPE_WORDS for x in inside):
                        cast_close.add(i)
            continue
        if t.kind in ("name", "number") and ends_operand:
            error(t, f"expected an operator before {t.text!r}")
            continue
        if t.kind != "name":
            continue
        name = t.text
        if name in TYPE_WORDS or name in OTHER_WORDS or name in CONSTANTS or name in ("step", "D"):
            continue
        if name in MATH_FUNCTIONS:
            if i + 1 >= len(tokens) or tokens[i + 1].text != "(":
                error(t, f"{name!r} is a function: call it")
            continue
        if name in declared.hyperparameters or name in row_values:
            used.add(name)
            continue
        if name in element_values or name in ("col", "partner") or name in declared.temporaries:
            error(t, f"{name!r} has one value per element; a reduce stage's `of:` is evaluated once per row "
                     f"(it reads {reads})")
        elif name in ROW_REDUCTIONS:
            error(t, f"{name}(...) is a row reduction of `update`; the reduce stage itself is the reduction "
                     f"over the table's rows (`of:` is the value of one row)")
        else:
            known = set(declared.hyperparameters) | row_values | {"step", "D"}
            error(t, f"unknown name {name!r}{_suggest(name, known | MATH_FUNCTIONS)}")
    for o in opened:
        error(tokens[o], "unbalanced brackets: '(' is never closed (missing ')')")
    if tokens and not (tokens[-1].kind in ("name", "number") or tokens[-1].text == ")"):
        error(tokens[-1], f"the expression ends with {tokens[-1].text!r}: an operand is missing")
    return findings


# ---- the reference -----------------------------------------------------------------------------

REFERENCE_BOUND = frozenset({"g", "w", "step", "D", "torch", "math"})


def _statement_targets(stmt) -> List[ast.Name]:
    """The names a statement binds by assignment, augmented assignment, a for loop or a with."""
    out = []
    for node in ast.walk(stmt):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.With)):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if not isinstance(node, ast.With) else [i.optional_vars for i in node.items if i.optional_vars])
            for t in targets:
                out.extend(n for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def _read_before_assigned(body, known: Set[str]) -> Set[ast.Name]:
    """Name loads of `body` (statements in order) that come before any assignment of the name, for
    names not in `known`. Branches count as assigning what either of them assigns."""
    early: Set[ast.Name] = set()
    bound = set(known)

    def loads(node):
        return [n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]

    def visit(stmts, bound):
        for stmt in stmts:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                value = stmt.value
                early.update(n for n in (loads(value) if value is not None else []) if n.id not in bound)
                bound |= {n.id for n in _statement_targets(stmt)}
            elif isinstance(stmt, ast.AugAssign):
                early.update(n for n in loads(stmt.value) if n.id not in bound)
                if isinstance(stmt.target, ast.Name) and stmt.target.id not in bound:
                    early.add(stmt.target)  # (read before it is written)
                bound |= {n.id for n in _statement_targets(stmt)}
            elif isinstance(stmt, (ast.If, ast.While)):
                early.update(n for n in loads(stmt.test) if n.id not in bound)
                a, b = set(bound), set(bound)
                visit(stmt.body, a)
                visit(stmt.orelse, b)
                bound |= a | b
            elif isinstance(stmt, ast.For):
                early.update(n for n in loads(stmt.iter) if n.id not in bound)
                bound |= {n.id for n in ast.walk(stmt.target) if isinstance(n, ast.Name)}
                inner = set(bound)
                visit(stmt.body, inner)
                visit(stmt.orelse, inner)
                bound |= inner
            elif isinstance(stmt, ast.Expr):
                early.update(n for n in loads(stmt.value) if n.id not in bound)
            else:  # (anything else: every name it binds counts from here, nothing is reported)
                bound |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}

    visit(body, bound)
    return early


def check_reference(source: Source, declared: Declared, table: bool = False, reduce: bool = False) -> List[Finding]:
    """Names the reference reads must exist: the bound names, hyperparameters, states, Python's
    built-ins, or a name the reference itself assigns somewhere. `table`: the `table_reference`,
    which has no gradient `g` (it runs over whole tables before a step's forward)."""
    try:
        tree = ast.parse(source.code)
    except SyntaxError:
        return []  # reported by the loader
    assigned: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            assigned.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assigned.add(node.name)
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs if hasattr(node, "args") else []:
                assigned.add(a.arg)
        elif isinstance(node, ast.Lambda):
            assigned.update(a.arg for a in node.args.args)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            assigned.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            assigned.add(node.name)
    bound = REFERENCE_BOUND - {"g"} if table else REFERENCE_BOUND
    states = set(declared.states)
    if reduce:  # `table_state_reference`: the per-row and per-table states, over all tables
        bound = {"step", "torch", "math"}
        states = declared.row_states() | declared.table_states()
    known = bound | set(declared.hyperparameters) | states | assigned | set(dir(builtins))
    lines = source.code.splitlines()
    findings = []
    # a name the reference assigns counts only after its first assignment, in statement order
    # (`v = beta * v + g` with no `v` declared reads a name nothing defined: a NameError when run)
    statement_stores = {n.id for stmt in tree.body for n in _statement_targets(stmt)}
    declared_names = bound | set(declared.hyperparameters) | states | set(dir(builtins))
    early = _read_before_assigned(tree.body, known - (statement_stores - declared_names))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and (node.id not in known or node in early):
            text = lines[node.lineno - 1] if node.lineno - 1 < len(lines) else ""
            col = len(text.encode("utf-8")[: node.col_offset].decode("utf-8", "replace"))
            line, file_col = source.at(node.lineno - 1, col)
            hint = " (temporaries exist only in the update stages)" if node.id in declared.temporaries else \
                _suggest(node.id, (declared_names | assigned) - set(dir(builtins)) - {node.id})
            if not hint:
                untouched = sorted(states - {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)})
                if untouched:
                    hint = (f" (the reference never uses the state{'s' if len(untouched) > 1 else ''} "
                            f"{', '.join(repr(u) for u in untouched)}: is {node.id!r} a renamed one?)")
            if node in early and node.id in known:
                findings.append(Finding(line, file_col, source.field,
                                        f"{node.id!r} is read before the reference assigns it, and the spec declares "
                                        f"no state or hyperparameter of that name{hint}"))
            else:
                findings.append(Finding(line, file_col, source.field, f"unknown name {node.id!r}{hint}"))
    return sorted(findings, key=lambda f: (f.line, f.col))

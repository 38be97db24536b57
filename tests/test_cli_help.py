"""The command line says that specs are code where it matters: `validate` and `test` help."""

from click.testing import CliRunner

from tbegen.cli import main


def test_validate_and_test_help_say_that_specs_are_code():
    for command in ("validate", "test"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0
        text = " ".join(result.output.split())
        assert "specs are code, like a makefile or setup.py" in text.lower(), text
        assert "executes" in text and "C++ snippets" in text, text

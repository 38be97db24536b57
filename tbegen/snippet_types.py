"""Types in the snippet language: the mistakes of type a compiler would accept (or reject late),
found at the YAML line and column before any compiler runs.

Every expression of an update stage, a guard (`when:`) and a reduce expression gets the type C++
gives it when the kernels compile it: `step` and int hyperparameters and int states are int64, `D`
and `col` int, float hyperparameters, weights, gradients, float states and temporaries float, a
literal `1` int, `1.0f` float and `1.0` double, comparisons bool; arithmetic follows C++'s usual
conversions (any floating operand makes the result floating, else the wider integer). Reported:

- an integer division whose result is used as a float (`float ramp = step / warmup_steps;`, or
  `learning_rate * (step / period)`): C++ drops the fraction first. A warning, with the fix
  `(float)step / warmup_steps`.
- a float stored into an int (an int state, an int local; `=`, `+=` and the like): truncated
  toward zero. A warning, with the fixes (an explicit cast, or a float).
- an int64 value stored into a 32-bit `int` local: a narrowing that can lose the value. A warning.
- `%` with a floating operand: C++ refuses it. An error: use fmodf.
- `==` or `!=` between floating values (other than an exact zero): rounding makes exact equality
  a matter of luck. A warning.

`tbegen validate --strict` turns the warnings into errors. The checker runs only on stages the
snippet checker (tbegen/snippets.py) accepted, and it never guesses: a construct it does not
model (it should not meet one) is skipped, not reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .model import ROW_REDUCTIONS
from .snippets import MATH_FUNCTIONS, Finding, Source, StageSource, _Token, tokenize

INT, INT64, FLOAT, DOUBLE, BOOL = "int", "int64", "float", "double", "bool"
_FLOATING = (FLOAT, DOUBLE)
_INTEGRAL = (INT, INT64, BOOL)

# a declared local's type words -> its type
_TYPE_WORDS = {
    ("float",): FLOAT, ("double",): DOUBLE, ("bool",): BOOL, ("int",): INT, ("int32_t",): INT,
    ("uint32_t",): INT, ("int64_t",): INT64, ("uint64_t",): INT64, ("long",): INT64, ("long", "long"): INT64,
    ("unsigned",): INT, ("unsigned", "int"): INT, ("long", "int"): INT64, ("unsigned", "long"): INT64,
}
_TYPE_WORD_SET = {w for words in _TYPE_WORDS for w in words} | {"const", "auto"}
# binary operators by precedence (lowest first), all left-associative
_BINARY = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"),
           ("+", "-"), ("*", "/", "%")]
_COMPARISONS = {"==", "!=", "<", ">", "<=", ">=", "&&", "||", "!"}
_DOUBLE_MATH = {"sqrt", "cbrt", "pow", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "fabs", "fmax",
                "fmin", "copysign", "floor", "ceil", "round", "trunc", "fmod", "tanh", "sin", "cos", "tan", "atan",
                "atan2", "erf", "erfc", "hypot", "fma"}
_REDUCTIONS = set(ROW_REDUCTIONS) if not isinstance(ROW_REDUCTIONS, dict) else set(ROW_REDUCTIONS.keys())


class _Skip(Exception):
    """A construct the type checker does not model: the statement is left unchecked."""


@dataclass
class _Value:
    type: str
    first: int  # token span [first, last] of the expression
    last: int
    # integer divisions inside this (integer) expression whose result has not been used yet:
    # (index of the '/' token, left operand's span, right operand's span)
    divisions: List[Tuple[int, Tuple[int, int], Tuple[int, int]]] = field(default_factory=list)
    zero: bool = False  # a literal 0 / 0.0 / 0.0f


def arithmetic(a: str, b: str) -> str:
    """C++'s usual arithmetic conversions, as far as the snippet language needs them."""
    if DOUBLE in (a, b):
        return DOUBLE
    if FLOAT in (a, b):
        return FLOAT
    return INT64 if INT64 in (a, b) else INT


def literal_type(text: str) -> str:
    t = text.lower()
    if t.startswith("0x"):
        return INT64 if "l" in t else INT
    if t.endswith("f") and ("." in t or "e" in t):
        return FLOAT
    if "." in t or "e" in t:
        return DOUBLE
    return INT64 if "l" in t else INT


class _Checker:
    def __init__(self, source: Source, names: Dict[str, str], findings: List[Finding], states: Sequence[str] = ()):
        self.source = source
        self.names = names  # name -> type, locals added as they are declared
        self.states = set(states)  # (which names are states: for the messages)
        self.findings = findings
        self.tokens, problems = tokenize(source.code)
        if problems:
            raise _Skip()
        self.i = 0

    # ---- reporting ----

    def report(self, tok_index: int, message: str, warning: bool) -> None:
        tok = self.tokens[tok_index]
        line, col = self.source.at(tok.line, tok.col)
        self.findings.append(Finding(line, col, self.source.field, message, warning=warning))

    def text(self, first: int, last: int) -> str:
        """The source text of tokens first..last (as written, on one line)."""
        out = []
        for k in range(first, last + 1):
            tok = self.tokens[k]
            if out and k > first:
                prev = self.tokens[k - 1]
                if prev.end_line != tok.line or prev.end_col != tok.col:
                    out.append(" ")
            out.append(tok.text)
        return "".join(out)

    def used_as_float(self, value: _Value) -> None:
        """`value`'s pending integer divisions meet a floating context: each is reported."""
        for slash, (a0, a1), (b0, b1) in value.divisions:
            left, right = self.text(a0, a1), self.text(b0, b1)
            if a0 != a1 and not (self.tokens[a0].text == "(" and self.tokens[a1].text == ")"):
                left_cast = f"(float)({left})"
            else:
                left_cast = f"(float){left}"
            self.report(slash, f"integer division: `{left} / {right}` divides two integers, so the fraction is "
                               f"dropped before the result is used as a float (a warm-up ramp written this way stays "
                               f"0 until it ends); write `{left_cast} / {right}`", warning=True)
        value.divisions = []

    # ---- tokens ----

    def peek(self, offset: int = 0) -> Optional[_Token]:
        k = self.i + offset
        return self.tokens[k] if k < len(self.tokens) else None

    def at_text(self, *texts: str, offset: int = 0) -> bool:
        tok = self.peek(offset)
        return tok is not None and tok.text in texts

    def take(self, text: Optional[str] = None) -> int:
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text):
            raise _Skip()
        self.i += 1
        return self.i - 1

    # ---- statements ----

    def run(self) -> None:
        while self.i < len(self.tokens):
            start = self.i
            try:
                self.statement()
            except _Skip:
                # leave the rest of this statement unchecked
                self.i = max(self.i, start + 1)
                while self.i < len(self.tokens) and self.tokens[self.i].text not in (";", "{", "}"):
                    self.i += 1
                if self.i < len(self.tokens):
                    self.i += 1

    def statement(self) -> None:
        tok = self.peek()
        if tok.text in ("{", "}", ";"):
            self.i += 1
            return
        if tok.text in ("if", "while"):
            self.i += 1
            self.take("(")
            cond = self.expression()
            self.take(")")
            self.boolean(cond)
            return
        if tok.text == "else":
            self.i += 1
            return
        if tok.kind == "name" and tok.text in _TYPE_WORD_SET and not self.at_text("(", offset=1):
            self.declaration()
            return
        if tok.text in ("++", "--"):
            self.i += 1
            self.take()
            self.take(";")
            return
        if tok.kind == "name" and self.peek(1) is not None and self.peek(1).text in (
                "=", "+=", "-=", "*=", "/=", "%=") and tok.text in self.names:
            target = self.i
            self.i += 1
            op = self.take()
            value = self.expression()
            self.store(target, self.names[tok.text], value, self.tokens[op].text)
            self.take(";")
            return
        value = self.expression()
        if self.at_text("++", "--"):
            self.i += 1
        self.take(";")

    def declaration(self) -> None:
        words = []
        while self.peek() is not None and self.peek().kind == "name" and self.peek().text in _TYPE_WORD_SET:
            word = self.peek().text
            if word != "const":
                words.append(word)
            self.i += 1
        if words == ["auto"]:
            declared = None
        else:
            declared = _TYPE_WORDS.get(tuple(words))
            if declared is None:
                raise _Skip()
        while True:
            name = self.take()
            if self.tokens[name].kind != "name":
                raise _Skip()
            if self.at_text("="):
                self.i += 1
                value = self.expression()
                ty = value.type if declared is None else declared
                if declared is not None:
                    self.store(name, declared, value, "=")
                elif ty in _FLOATING:
                    self.used_as_float(value)
                self.names[self.tokens[name].text] = ty
            elif declared is not None:
                self.names[self.tokens[name].text] = declared
            else:
                raise _Skip()
            if self.at_text(","):
                self.i += 1
                continue
            self.take(";")
            return

    def store(self, target: int, target_type: str, value: _Value, op: str) -> None:
        """Checks `target op value` (op: '=' or a compound assignment)."""
        name = self.tokens[target].text
        if op == "%=" and (target_type in _FLOATING or value.type in _FLOATING):
            self.report(target, f"`%=` needs integer operands; {name!r} or its value is a float: write "
                                f"`{name} = fmodf({name}, ...)`", warning=False)
            return
        if target_type in _FLOATING:
            self.used_as_float(value)
            return
        if target_type in (INT, INT64) and value.type in _FLOATING:
            kind = "state" if self._is_state(name) else "variable"
            self.report(target, f"{name!r} is an int {kind} but is assigned a float expression "
                                f"(`{self.text(value.first, value.last)}`): C++ truncates it toward zero; if "
                                f"that is meant, cast it (`(int64_t)(...)`, after floorf/roundf if you want "
                                f"those), otherwise make {name!r} a float", warning=True)
            return
        if target_type == INT and value.type == INT64 and op == "=":
            self.report(target, f"{name!r} is a 32-bit int but `{self.text(value.first, value.last)}` is int64 "
                                f"(`step`, int hyperparameters and int states are int64): the value can be cut; "
                                f"declare {name!r} as int64_t", warning=True)

    def _is_state(self, name: str) -> bool:
        return name in self.states

    def boolean(self, value: _Value) -> None:
        value.divisions = []

    # ---- expressions (precedence climbing) ----

    def expression(self) -> _Value:
        return self.conditional()

    def conditional(self) -> _Value:
        cond = self.binary(0)
        if not self.at_text("?"):
            return cond
        self.i += 1
        self.boolean(cond)
        a = self.conditional()
        self.take(":")
        b = self.conditional()
        ty = arithmetic(a.type, b.type) if a.type != BOOL or b.type != BOOL else BOOL
        out = _Value(ty, cond.first, b.last)
        if ty in _FLOATING:
            self.used_as_float(a)
            self.used_as_float(b)
        else:
            out.divisions = a.divisions + b.divisions
        return out

    def binary(self, level: int) -> _Value:
        if level == len(_BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() is not None and self.peek().text in _BINARY[level]:
            op = self.take()
            right = self.binary(level + 1)
            left = self.combine(left, op, right)
        return left

    def combine(self, a: _Value, op_index: int, b: _Value) -> _Value:
        op = self.tokens[op_index].text
        if op in _COMPARISONS:
            if op in ("==", "!=") and a.type in _FLOATING and b.type in _FLOATING and not (a.zero or b.zero):
                self.report(op_index, f"`{self.text(a.first, b.last)}` compares floats for exact equality: "
                                      f"rounding makes it a matter of luck; compare with a tolerance "
                                      f"(`fabsf(a - b) <= tol`), or compare integers", warning=True)
            if a.type in _FLOATING or b.type in _FLOATING:
                self.used_as_float(a)
                self.used_as_float(b)
            return _Value(BOOL, a.first, b.last)
        if op == "%":
            if a.type in _FLOATING or b.type in _FLOATING:
                which = self.text(a.first, a.last) if a.type in _FLOATING else self.text(b.first, b.last)
                self.report(op_index, f"`%` needs integer operands, but `{which}` is a float (C++ refuses it): "
                                      f"write `fmodf({self.text(a.first, a.last)}, {self.text(b.first, b.last)})`, "
                                      f"or declare the hyperparameter `type: int`", warning=False)
                return _Value(FLOAT, a.first, b.last)
        if op in ("<<", ">>", "&", "|", "^") and (a.type in _FLOATING or b.type in _FLOATING):
            raise _Skip()  # (the snippet checker's business; C++ refuses it)
        ty = arithmetic(a.type, b.type)
        out = _Value(ty, a.first, b.last)
        if ty in _FLOATING:
            self.used_as_float(a)
            self.used_as_float(b)
            return out
        out.divisions = a.divisions + b.divisions
        if op == "/":
            out.divisions.append((op_index, (a.first, a.last), (b.first, b.last)))
        return out

    def unary(self) -> _Value:
        tok = self.peek()
        if tok is None:
            raise _Skip()
        if tok.text in ("-", "+", "!", "~"):
            start = self.take()
            value = self.unary()
            if tok.text == "!":
                self.boolean(value)
                return _Value(BOOL, start, value.last)
            ty = INT if value.type == BOOL else value.type
            return _Value(ty, start, value.last, value.divisions, value.zero)
        if tok.text == "(" and self._is_cast():
            start = self.take("(")
            words = []
            while not self.at_text(")"):
                word = self.tokens[self.take()].text
                if word != "const":
                    words.append(word)
            self.take(")")
            ty = _TYPE_WORDS.get(tuple(words))
            if ty is None:
                raise _Skip()
            value = self.unary()
            return _Value(ty, start, value.last)
        return self.postfix()

    def _is_cast(self) -> bool:
        k = self.i + 1
        words = []
        while k < len(self.tokens) and self.tokens[k].kind == "name" and self.tokens[k].text in _TYPE_WORD_SET:
            words.append(self.tokens[k].text)
            k += 1
        return bool(words) and k < len(self.tokens) and self.tokens[k].text == ")"

    def postfix(self) -> _Value:
        tok = self.peek()
        start = self.i
        if tok.text == "(":
            self.i += 1
            inner = self.expression()
            end = self.take(")")
            return _Value(inner.type, start, end, inner.divisions, inner.zero)
        if tok.kind == "number":
            self.i += 1
            zero = all(c in "0.xXfFlLuU" for c in tok.text) and not tok.text.lower().startswith("0x1")
            return _Value(literal_type(tok.text), start, start, zero=zero and tok.text.strip("0.fFlLuU") == "")
        if tok.kind != "name":
            raise _Skip()
        name = tok.text
        self.i += 1
        if name == "static_cast":
            self.take("<")
            words = []
            while not self.at_text(">"):
                word = self.tokens[self.take()].text
                if word != "const":
                    words.append(word)
            self.take(">")
            self.take("(")
            inner = self.expression()
            end = self.take(")")
            ty = _TYPE_WORDS.get(tuple(words))
            if ty is None:
                raise _Skip()
            return _Value(ty, start, end)
        if name in ("true", "false"):
            return _Value(BOOL, start, start)
        if name in ("INFINITY", "NAN"):
            return _Value(FLOAT, start, start)
        if self.at_text("("):
            self.i += 1
            args = []
            if not self.at_text(")"):
                while True:
                    args.append(self.expression())
                    if self.at_text(","):
                        self.i += 1
                        continue
                    break
            end = self.take(")")
            if name in _REDUCTIONS:
                for a in args:
                    self.used_as_float(a)
                return _Value(FLOAT, start, end)
            if name in MATH_FUNCTIONS:
                for a in args:
                    self.used_as_float(a)
                double = name in _DOUBLE_MATH and any(a.type == DOUBLE for a in args)
                return _Value(DOUBLE if double else FLOAT, start, end)
            raise _Skip()
        ty = self.names.get(name)
        if ty is None:
            raise _Skip()
        return _Value(ty, start, start)


def _stage_names(kind: str, names: Dict[str, str]) -> Dict[str, str]:
    out = dict(names)
    out.update(g=FLOAT, w=FLOAT, step=INT64, D=INT)
    if kind == "table":
        out["col"] = INT
    return out


def check_types(stages: Sequence[StageSource], names: Dict[str, str], states: Sequence[str] = ()) -> List[Finding]:
    """Findings of type in the stages (and their guards), in stage order. `names`: every declared
    hyperparameter, state and temporary with its type (INT64, FLOAT or BOOL); `states`: which of
    them are states (for the messages)."""
    findings: List[Finding] = []
    row_locals: Dict[str, str] = {}
    for stage in stages:
        scope = _stage_names(stage.kind, names)
        if stage.kind in ("row", "element"):
            scope.update(row_locals)
        for source, expression in ((stage.when, True), (stage.source, stage.kind == "reduce")):
            if source is None:
                continue
            try:
                checker = _Checker(source, scope, findings, states)
            except _Skip:
                continue
            if expression:
                try:
                    value = checker.expression()
                    if source is stage.when:
                        checker.boolean(value)
                    else:
                        checker.used_as_float(value)
                except _Skip:
                    pass
            else:
                checker.run()
        if stage.kind == "row":
            row_locals.update({k: v for k, v in scope.items() if k not in names and k not in ("g", "w", "step", "D", "col")})
    return findings

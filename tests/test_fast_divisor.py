"""FastDivisor (templates/include/tbegen/common.h): the CUDA backward's division of bag numbers by
the batch size, by a multiply and a shift. Compiled here as a small host program and compared with
the division operator: every dividend for small divisors, and the edges of the range (0, 2^31 - 1,
multiples of the divisor and their neighbours) for divisors up to 2^31 - 1."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include "tbegen/common.h"

static int failures = 0;
static void check(int64_t d, int32_t n) {
  const tbegen::FastDivisor f = tbegen::FastDivisor::of(d);
  const int32_t want = int32_t(int64_t(n) / d);
  if (f.quotient(n) != want && ++failures <= 10)
    std::printf("d=%lld n=%d: got %d, want %d\n", (long long)d, n, f.quotient(n), want);
}

int main() {
  const int32_t top = 2147483647;
  for (int64_t d = 1; d <= 300; ++d)
    for (int32_t n = 0; n < 100000; ++n) check(d, n);
  uint64_t x = 88172645463325252ull;  // xorshift: divisors of every magnitude
  for (int i = 0; i < 200000; ++i) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    const int64_t d = 1 + int64_t(x % uint64_t(top)) / (int64_t(1) << (x >> 59));  // d in [1, 2^31 - 1]
    const int64_t q = int64_t(x >> 20) % (int64_t(top) / d + 1);
    for (int64_t n : {q * d - 1, q * d, q * d + d - 1, int64_t(top), int64_t(0), int64_t(top) - int64_t(top) % d})
      if (n >= 0 && n <= top) check(d, int32_t(n));
  }
  for (int64_t d : {int64_t(1) << 30, (int64_t(1) << 30) + 1, int64_t(top) - 1, int64_t(top)})
    for (int32_t n : {0, 1, int32_t(d - 1), top - 1, top}) if (n >= 0) check(d, n);
  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def test_fast_divisor_equals_division(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    from torch.utils.cpp_extension import include_paths

    src = tmp_path / "fast_divisor.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "fast_divisor"
    includes = [f"-I{ROOT / 'templates' / 'include'}"] + [f"-I{p}" for p in include_paths()]
    subprocess.run([cxx, "-std=c++17", "-O2", *includes, str(src), "-o", str(exe)], check=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip() == "0 failures"

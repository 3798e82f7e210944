"""The fingerprint kernel's instruction mix per 8-byte word, read from its SASS for sm_90 (H100 / H200), compiled
here without a GPU by the ptxas that ships with Triton: the narrow whole-word loop against the wide one
(`trainerkit.fingerprint_kernels._words_block_dyn`, ``narrow`` in `fingerprint_gpu.DEFAULT`).

    python3 bench/sass_fingerprint.py [--out FILE.json]

Why count: the kernel is bound by the integer ALU pipe on an H200 (16 lanes per SM sub-partition: a warp's ALU
instruction occupies it 2 cycles), not by its loads, so ALU instructions per word set its ceiling.  Counted over
the hottest loop (the largest block a backward branch closes), divided by the words a thread handles per trip
(``wpt``).  Pipes: IMAD* on the multiply-add pipe; loads; uniform-datapath and branch instructions apart; the
rest (LOP3, SHF, IADD3, LEA, VIADD, ISETP ...) on the ALU pipe.  Numbers depend on the ptxas version.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# integer kernels: floating-point fusion changes nothing here; set, it silences Triton 3.9's warning about its default
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from _refuse import fail, out_file  # noqa: E402  (bench/, the script's own directory, is first on sys.path)

from trainerkit import fingerprint_gpu as fg  # noqa: E402
from trainerkit import fingerprint_kernels as fk  # noqa: E402

_PIPES = (("fma", ("IMAD", "IMUL")), ("mem", ("LDG", "STG", "ATOM", "RED", "LDC", "LDS", "STS")),
          ("other", ("U", "R2UR", "S2UR", "BRA", "BAR", "NOP", "EXIT")))


def compile_sass(esize: int, narrow: bool, mis: int = 0) -> str:
    """SASS of `_contig_kernel` for sm_90 at the DEFAULT geometry; esize 4 (fp32) or 2 (bf16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cfg = fg._cfg({})
    subw, blockw = fg._geometry(cfg)
    k = fk._contig_kernel
    const = {"BLOCKW": blockw, "SUBW": subw, "ESIZE": esize, "ALIGN16": mis == 0, "MIS": mis, "DYN": True,
             "NARROW": narrow}
    sig = {"base": {4: "*i32", 2: "*i16"}[esize], "items": "*i64", "gtab": "*i64", "sums": "*i64",
           **{n: "constexpr" for n in const}}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(4) if i or mis == 0})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg["num_warps"], "num_stages": cfg["stages"]})
    return compiled.asm["sass"]


def hot_loop_mix(sass: str) -> collections.Counter:
    """Opcode counts of the largest block closed by a backward branch."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\w+:", line.strip())}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA (\w+);", line)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        raise SystemExit("sass_fingerprint: no loop found in the SASS")
    ops: collections.Counter = collections.Counter()
    for line in lines[best[0] + 1: best[1] + 1]:
        m = re.match(r"^[^\t]*\t(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def per_word(ops: collections.Counter, words: int) -> dict:
    out = {pipe: 0 for pipe, _ in _PIPES}
    out["alu"] = 0
    for op, n in ops.items():
        pipe = next((p for p, prefixes in _PIPES if op.startswith(prefixes)), "alu")
        out[pipe] += n
    out["total"] = sum(ops.values())
    return {k: round(v / words, 2) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    out = out_file(args.out)
    if not fk.HAVE_TRITON:
        fail("needs Triton (pip install triton)")
    import triton
    wpt = fg.DEFAULT["wpt"]
    rows = []
    for esize, dtype in ((4, "fp32"), (2, "bf16")):
        for narrow in (False, True):
            mix = per_word(hot_loop_mix(compile_sass(esize, narrow)), wpt)
            rows.append({"dtype": dtype, "narrow": narrow, "per_word": mix})
            print(f"{dtype} narrow={narrow!s:5}  per word: {mix['total']:5.2f} instructions, ALU {mix['alu']:5.2f},"
                  f" multiply-add {mix['fma']:5.2f}, memory {mix['mem']:4.2f}")
    if out:
        geometry = {k: fg.DEFAULT[k] for k in ("num_warps", "wpt", "nsub", "stages")}
        out.write_text(json.dumps({"triton": triton.__version__, "target": "sm_90", "geometry": geometry,
                                   "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

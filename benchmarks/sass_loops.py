"""Instruction mix of the inner loops of a kernel's SASS (cuobjdump -sass output on stdin): for each
backward branch whose body holds tensor-core mmas, the instruction count and the count per opcode, sm_90
code only unless --arch says otherwise. Works on the .so built on the device machine and on the objects of
`make -C csrc` anywhere (cuobjdump: the CUDA toolkit, or PyPI's nvidia-cuda-cuobjdump wheel):

    cuobjdump -sass rocket_mpi/_C*.so | python3 benchmarks/sass_loops.py [name substring, e.g. experts_gemm]
    make -C csrc ARCHS=90 && cuobjdump -sass csrc/build/nvfp4_experts.o | python3 benchmarks/sass_loops.py

An unrolled loop shows its whole body (e.g. 4 k-tiles of the expert kernel: HMMA 32 at one row tile);
"spill" counts the local-memory loads and stores in it. The expert kernel's decode runs on the integer
(ALU) pipe: LOP3/SHF/IADD3/ISETP there, IMAD and HMUL2 on the FMA pipe (csrc/nvfp4_experts.cu)."""
import argparse
import re
import sys
from collections import Counter

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("name", nargs="?", default="", help="substring of the function names to report")
ap.add_argument("--arch", default="sm_90")
args = ap.parse_args()

ALU = {"LOP3", "SHF", "IADD3", "ISETP", "LEA", "PRMT", "SEL", "IABS", "FLO", "POPC", "BMSK", "SGXT"}
functions: list[tuple[str, list[tuple[int, str]]]] = []
arch = ""
for line in sys.stdin:
    if "code for sm_" in line:
        arch = line.split("code for")[1].strip()
        continue
    if "Function :" in line:
        functions.append((line.split("Function :")[1].strip(), []) if arch == args.arch and args.name in line
                         else ("", []))
        continue
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m and functions and functions[-1][0]:
        functions[-1][1].append((int(m.group(1), 16), m.group(2).strip()))

for name, ins in functions:
    if not name:
        continue
    print(name[:140])
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo = int(m.group(1), 16)
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins if lo <= a <= addr)
        if ops.get("HMMA", 0) < 4:
            continue
        alu = sum(v for k, v in ops.items() if k in ALU)
        spill = ops.get("LDL", 0) + ops.get("STL", 0)
        print(f"  loop {lo:#x}-{addr:#x}: {sum(ops.values())} instructions, HMMA {ops['HMMA']}, integer pipe {alu}, "
              f"IMAD {ops.get('IMAD', 0)}, HMUL2 {ops.get('HMUL2', 0)}, spill {spill}: {dict(ops.most_common(10))}")

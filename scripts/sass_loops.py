"""Instruction mix of the inner loops of a kernel's SASS (cuobjdump -sass output on stdin): for each
backward branch whose body holds tensor-core mmas, the count per opcode. Use on the device machine:

    cuobjdump -sass rocket_mpi/_C*.so | python3 scripts/sass_loops.py [name substring, e.g. experts_gemm]

The expert kernel's main loop is bound by its integer (ALU) pipe: LOP3/SHF/IADD3/ISETP there, IMAD and
HMUL2 on the FMA pipe (csrc/nvfp4_experts.cu, Mul)."""
import re
import sys
from collections import Counter

want = sys.argv[1] if len(sys.argv) > 1 else ""
ins, keep = [], not want
for line in sys.stdin:
    if "Function :" in line:
        keep = want in line
        if keep:
            print(line.strip()[:140])
        continue
    if not keep:
        continue
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
ALU = {"LOP3", "SHF", "IADD3", "ISETP", "LEA", "PRMT", "SEL", "IABS", "FLO", "POPC", "BMSK", "SGXT"}
for addr, text in ins:
    m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
    if not m or int(m.group(1), 16) >= addr:
        continue
    lo = int(m.group(1), 16)
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins if lo <= a <= addr)
    if ops.get("HMMA", 0) >= 4:
        alu = sum(v for k, v in ops.items() if k in ALU)
        print(f"loop {lo:#x}-{addr:#x}: {sum(ops.values())} instructions, HMMA {ops['HMMA']}, integer pipe {alu}, "
              f"IMAD {ops.get('IMAD', 0)}, HMUL2 {ops.get('HMUL2', 0)}: {dict(ops.most_common(12))}")

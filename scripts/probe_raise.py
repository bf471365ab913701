import sys, torch
from rocket_mpi.kernels import _ext
C = _ext.require()
which = sys.argv[1]
try:
    if which == "bind":
        C.rms_norm(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16), 1e-5)
    else:
        d = torch.device("cuda"); n = 8
        C.moe_plan(torch.zeros(300, 8, dtype=torch.long, device=d), torch.ones(300, 8, device=d),
                   torch.zeros(n, dtype=torch.int32, device=d), torch.arange(n, dtype=torch.int32, device=d),
                   torch.arange(n, dtype=torch.int32, device=d), torch.ones(n, device=d), 0, 1, 1, 2400,
                   torch.zeros(1, dtype=torch.long, device=d))
except RuntimeError as e:
    print("RAISED", str(e)[:200])

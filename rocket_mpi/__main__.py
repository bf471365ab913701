import sys

from rocket_mpi.cli import main

sys.exit(main())

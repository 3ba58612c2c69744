import sys

from fourd_mpi.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

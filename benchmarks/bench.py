"""`python benchmarks/bench.py {vocab-cpu,vocab-gpu} [--quick] [--out DIR]`, as `klest bench`."""

import sys

from klest.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

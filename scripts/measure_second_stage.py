"""Does a second embedder pay as the verifier's second stage? (``--help``)

The code is :mod:`edgecache.bench.second_stage`."""

from edgecache.bench.second_stage import main

if __name__ == "__main__":
    raise SystemExit(main())

"""Measure the semantic lookup path against plain cosine, side by side (the protocols: ``--help``).

The code is :mod:`edgecache.bench.semantic_eval`."""

from edgecache.bench.semantic_eval import main

if __name__ == "__main__":
    main()

"""Fit the semantic verifier (edgecache/semantic/verifier_params.json) from the permissive sets (``--help``).

The code is :mod:`edgecache.bench.verifier_fit`."""

from edgecache.bench.verifier_fit import main

if __name__ == "__main__":
    raise SystemExit(main())

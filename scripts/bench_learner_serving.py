"""The online learner measured through the real server, beside the shipped static rule (``--help``).

The code is :mod:`edgecache.bench.learner_serving`."""

from edgecache.bench.learner_serving import main

if __name__ == "__main__":
    main()

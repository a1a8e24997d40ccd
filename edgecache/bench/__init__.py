"""Measurement code: the evaluations, fits and benchmarks that scripts/ runs as command lines, and their one set of
helpers. A top floor: it imports the rest of the package, and nothing in the package imports it."""

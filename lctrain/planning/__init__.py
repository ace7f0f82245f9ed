"""Predictions from a config alone, with no process or device: parameter and memory formulas
(memory), traffic formulas (traffic) and the plan of a layout (plan). Derived in
docs/parallelism.md; tests compare each with what lctrain measures."""

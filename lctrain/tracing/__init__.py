"""The step observed rather than run: traced at full size on fake tensors for `lctrain plan
--trace` (its memory peak and parts, its host syncs), and the bytes a real step keeps, measured
by storage (what the planner's activation formulas are tested against).
"""

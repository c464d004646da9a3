"""Describing values without holding them: tensor and call specs, the per-call key, specs
as JSON, inputs materialised from specs, copies of mutable constants.
"""

"""The probe contract, the registry (built-ins, entry points, the default set), snapshots
of the probes' states and the cached observer that takes them per call.
"""

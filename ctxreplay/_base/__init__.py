"""What every layer stands on: strict JSON readers, the version and the environment a
document records, and what the installed torch can do.
"""

"""What every layer stands on: strict JSON readers, the version and the environment a
document records, what the installed torch can do, and the name -> plugin table the
probe and backend registries are made of, and the progress a long job shows.
"""

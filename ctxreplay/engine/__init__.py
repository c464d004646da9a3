"""``capture_with`` and ``CaptureSession``: observation opened on a model, and
``finalize()`` -- the safety net, progress, and the coverage that decides ok.
"""

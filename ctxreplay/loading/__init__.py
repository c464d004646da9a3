"""Using saved captures: ``load`` a manifest or one capture, what a capture needs and every
difference from now, the per-call guard, running with a member's weights.
"""

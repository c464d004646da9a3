"""One variant becomes one capture: the options and requests capture is given, isolation
(with the weights offloading hooks put in place, or FSDP2 gathers), tracing under the
replayed context, what the forward changed in its argument objects, the checker that runs
the artifact against every member call, the results, and merging identical graphs.
"""

"""The decode fast path and its stock twin: MiniMax-H3 video VAE clips sharded over a process group.

plan: the clip plan of the stock `_decode`; exchange: the fail-closed probe and clip all-gathers;
serve: the library's own post-loop over gathered clips; sharded: the stock and sharded entry points.
"""

"""The decode fast path and its stock twin: MiniMax-H3 video VAE work sharded over a process group.

plan: the clip plan of the stock `_decode`, its tile grid and the clips-or-tiles split; exchange: the
fail-closed probe, status exchanges and payload collectives; serve: the library's own post-loops over
gathered pieces; sharded: the stock and sharded decode/encode entry points; judge: what every rank
returned against the stock call; oracle: the plan against the library's own call sequence;
families: the VAE entry of the plugin registries.
"""

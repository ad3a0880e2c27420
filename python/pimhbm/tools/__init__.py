"""The commands of ``pimhbm`` besides the demo: gate, shard, recover, llama3."""

"""Process infrastructure of a launch: roles and process groups, channels, the device of each rank, nodes,
process lifetime, the local rank spawner, the CPU compatibility layer of Megatron-Core, and failpoints."""

"""DDMA: the plan of which trainer shard goes to which generator shard, the transports that move them, and the
versioned, atomic publish of new weights."""

"""Planning: the cost model, the topology, the plan data model and the algorithms that fill it."""

"""Pure decision modules of cluster jobs: plain data in, plain data out, `now` as an argument, no I/O.

- types: the frozen dataclasses everything below works on
- matcher: seats for one cluster (min-cost bipartite matching, zones, pins, waiting explanations)
- planner: one placement pass over every cluster able to start
- reservation: the aging-reservation step function
- coordinator: the prepare/start state machine of one attempt, prepare backoff, signal routing
- settlement: the verdict of a started attempt, how each member settles, startup recovery
"""

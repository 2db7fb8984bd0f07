"""The bottom layer: pure and shared. The vocabulary (every status and kind, once), job keys, ids, and
the wire protocol's types. Nothing here imports Django's database layer or any app of Gradient."""

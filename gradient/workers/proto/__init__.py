"""The /proto transport: the WebSocket consumer and the job loop (a typed message in, one domain call,
typed messages out). Only the edge imports it."""

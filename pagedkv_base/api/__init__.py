"""The OpenAI-style HTTP API both doors serve (the worker and the router):
request models (`protocol`), the error shape, body limit and API-key check
(`errors`), bodies parsed off the event loop (`bodies`) and client hang-ups
(`disconnect`)."""

"""The OpenAI-compatible HTTP front door: the same `Generation` as the gRPC servicer, in
OpenAI's wire format.

    api.py       the FastAPI app: routes, keys, body limit, replies (create_app)
    protocol.py  the request bodies, and their translation into a GenerateRequest
    render.py    Generation's outputs as chat.completion / text_completion bodies
    errors.py    OpenAI error bodies, with the HTTP status of the gRPC status
    sse.py       the Server-Sent Events response that stops when its client leaves
"""

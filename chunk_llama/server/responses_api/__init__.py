"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: `request.py` (validation
against the openai package's types, and the chat request a body means), `output.py` (output
items and stream events), `store.py` (responses kept for `previous_response_id`),
`routes.py` (the handlers)."""

"""Everything before a handler: ``listener`` (the listening socket, its connection limit and
header timeout), ``malformed_http`` (what aiohttp refuses before a handler, answered as the
API's JSON errors), ``browser_guard`` (browsers' cross-site requests, CORS), ``auth`` (API
keys)."""

"""What the gateway does to a request's text before the model reads it: pronunciation
dictionaries (``lexicon``, ``pls``, ``store``) then normalisation in the request's language
(English: ``normalize``; the others: ``intl``), resolved per request into a ``plan.TextPlan``
by ``service.SpeechText`` and applied to whole units of text
(``gateway.schemas.SpeechParams.spoken``); ``breaks`` reads the pauses written in the text
(``<break time="1s"/>``), which are never model text, and ``pauses`` cuts a request's text at
them, its runs spoken in turn with the pauses' silence between them. Pure Python, no I/O on the hot path
but one stat call per "latest" dictionary locator."""

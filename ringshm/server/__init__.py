"""HTTP: the OpenAI-compatible app over an ``AsyncEngine``, its request schemas and response builders, its
middleware (body cap, metrics) and info routes.
May import: everything below it (base, ``transport``, ``model``, ``runtime``, ``engine``) and this folder."""

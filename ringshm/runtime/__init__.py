"""Processes: the stage loop, spawning / watching / stopping stages and bridges, the resource checks made before
anything starts, and the worker that runs another host's share.
May import: the base modules, ``ringshm.transport``, ``ringshm.model`` and this folder."""

"""The job config: torchtitan's JobConfig with flame's fields, parsed from TOML < command line.

job (flame's fields: the ``--job.custom_config_module``), merge (how they meet torchtitan's, unused
fields), spellings (older spellings), paths (the settings that name paths: ``~`` and variables expanded; the
folders kept in the dump folder), manager (parsing). Parsing only parses: every check of the
values, and the memory plan, run in flame.prepare.
"""

"""OpenHA-style task files (data) for ``minecraft_tasks.load_openha_task``; a package so the YAMLs ship."""

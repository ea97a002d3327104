"""The Typer app behind the ``parallax`` command. Logging is configured here and only here."""

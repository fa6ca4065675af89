from spececd.cli import command

command()

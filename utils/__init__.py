"""The package the notebooks import: model, repository, server, client, bench and plots, one module each."""

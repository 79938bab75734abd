"""Model builders shipped for the load test and the tests: tiny random models, no downloads."""

"""Looking inside a model: the analyses (lens), the HTML report (report) and plots (plots)."""

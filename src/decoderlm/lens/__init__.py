"""Looking inside a model: the analyses (lens), the HTML report and the `decoderlm inspect`
command (report), and the plots of a run (plots)."""

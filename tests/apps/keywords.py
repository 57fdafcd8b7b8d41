"""An app whose settings come partly from App(...) keywords."""
from workhorse import App

app = App("keywords", max_deliveries=5)

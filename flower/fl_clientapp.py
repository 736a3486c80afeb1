"""The ClientApp: one client of the federation per node (node config `partition-id`), its handlers the
method files' client functions (fl_methods.HANDLERS)."""
import fl_adapter
import fl_methods

app = fl_adapter.client_app(fl_methods.HANDLERS)

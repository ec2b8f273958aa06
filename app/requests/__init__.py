"""The request contract: what a request may say, how it is admitted, published and waited on."""

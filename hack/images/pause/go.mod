module tetrad.dev/hack/images/pause

go 1.26.0

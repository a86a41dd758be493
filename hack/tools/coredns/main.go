// Command coredns is CoreDNS v1.15.0 (pinned in go.mod) with only the plugins
// the real nodes' Corefile uses (hack/cluster/real-nodes.sh): the upstream
// main imports every plugin, cloud SDKs included, which doubles the cold build.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}

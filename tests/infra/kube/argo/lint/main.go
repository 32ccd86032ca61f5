// Command argo-lint lints Argo Workflows manifests offline and strictly, with Argo's own lint
// package: what `argo lint --offline --strict` does, without the argo CLI (whose module zip, from
// v3.7 on, lacks the UI files it embeds). References between the files given are resolved among
// them. Exits 1, with Argo's messages, when any object fails or nothing was linted.
//
// scripts/build-argo copies this file into the Argo module it builds, and the tests run it on
// every shipped Argo file.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/argoproj/argo-workflows/v3/cmd/argo/lint"
	"github.com/argoproj/argo-workflows/v3/pkg/apiclient"
)

func main() {
	files := os.Args[1:]
	if len(files) == 0 {
		fmt.Fprintln(os.Stderr, "usage: argo-lint FILE...")
		os.Exit(2)
	}
	ctx, client, err := apiclient.NewClientFromOpts(apiclient.Opts{Offline: true, OfflineFiles: files,
		Context: context.Background()})
	if err != nil {
		fail(err)
	}
	clients := lint.ServiceClients{WorkflowsClient: client.NewWorkflowServiceClient()}
	if clients.WorkflowTemplatesClient, err = client.NewWorkflowTemplateServiceClient(); err != nil {
		fail(err)
	}
	if clients.CronWorkflowsClient, err = client.NewCronWorkflowServiceClient(); err != nil {
		fail(err)
	}
	if clients.ClusterWorkflowTemplateClient, err = client.NewClusterWorkflowTemplateServiceClient(); err != nil {
		fail(err)
	}
	formatter, err := lint.GetFormatter("simple")
	if err != nil {
		fail(err)
	}
	// No default namespace, as the argo CLI offline: objects without one find each other.
	res, err := lint.Lint(ctx, &lint.LintOptions{Files: files, Strict: true, Formatter: formatter,
		ServiceClients: clients, Printer: os.Stdout})
	if err != nil {
		fail(err)
	}
	if !res.Success {
		os.Exit(1)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "argo-lint:", err)
	os.Exit(2)
}

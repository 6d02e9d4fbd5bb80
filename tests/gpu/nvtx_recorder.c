/* A recorder of what a process tells a profiler, for tests/gpu/test_nsys_window.py.
 *
 * Loaded two ways into the training process:
 * - as an NVTX tool (NVTX_INJECTION64_PATH=<this library>): NVTX's header-only API, which torch
 *   and CUDA's libraries are built with, loads the tool named there at the first NVTX call and
 *   calls InitializeInjectionNvtx2; the tool then points NVTX's range push/pop at its own functions;
 * - preloaded (LD_PRELOAD), in front of the CUDA runtime's cudaProfilerStart/cudaProfilerStop,
 *   which it records and then calls.
 * Every event is one line "<pid> <event> [<message>]" appended to the file FLAME_PROFILER_RECORD names.
 * Only the constants of NVTX's injection interface are taken from its headers (nvtxDetail/nvtxTypes.h).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { ETID_CALLBACKS = 1, MODULE_CORE = 1, CORE_RANGE_PUSH_A = 9, CORE_RANGE_POP = 11 };

typedef void (*function_pointer)(void);
typedef struct {
    size_t struct_size;
    int (*get_module_function_table)(int module, function_pointer*** table, unsigned int* size);
} export_table_callbacks;

static void record(const char* event, const char* message) {
    const char* path = getenv("FLAME_PROFILER_RECORD");
    if (!path) return;
    char line[512];
    int n = snprintf(line, sizeof line, "%d %s%s%s\n", (int)getpid(), event, message ? " " : "", message ? message : "");
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0) return;
    if (n > (int)sizeof line - 1) n = sizeof line - 1;
    ssize_t written = write(fd, line, n); /* one short append: lines of several processes do not interleave */
    (void)written;
    close(fd);
}

static int range_push(const char* message) { record("push", message); return 0; }
static int range_pop(void) { record("pop", NULL); return 0; }

int InitializeInjectionNvtx2(const void* (*get_export_table)(uint32_t)) {
    const export_table_callbacks* callbacks = get_export_table(ETID_CALLBACKS);
    function_pointer** table = NULL;
    unsigned int size = 0;
    if (!callbacks || !callbacks->get_module_function_table(MODULE_CORE, &table, &size) || size <= CORE_RANGE_POP)
        return 0;
    *table[CORE_RANGE_PUSH_A] = (function_pointer)range_push;
    *table[CORE_RANGE_POP] = (function_pointer)range_pop;
    return 1;
}

static int forward(const char* name) {
    int (*real)(void) = (int (*)(void))dlsym(RTLD_NEXT, name);
    return real ? real() : 0;
}

int cudaProfilerStart(void) { record("cudaProfilerStart", NULL); return forward("cudaProfilerStart"); }
int cudaProfilerStop(void) { record("cudaProfilerStop", NULL); return forward("cudaProfilerStop"); }

// SPDX-License-Identifier: Apache-2.0
// Main of test_interposer_engine: a private directory and environment for the shim and simcuda, and
// exit 77 (skipped) where libcuda.so.1 is not simcuda (a GPU machine, or simcuda not built).
#define CATCH_CONFIG_RUNNER
#include <dirent.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

std::string g_test_dir;

int main(int argc, char** argv) {
  char dir[] = "/tmp/tmsdisk-engine-test-XXXXXX";
  if (!::mkdtemp(dir)) {
    std::perror("mkdtemp");
    return 1;
  }
  g_test_dir = dir;
  // Read once by the shim and by simcuda: set before either looks.
  ::setenv("TMSDISK_SOCKET", (g_test_dir + "/d.sock").c_str(), 1);
  ::setenv("TMSDISK_MIN_BYTES", "1048576", 1);
  ::setenv("TMSDISK_LOG", "error", 0);
  ::setenv("SIMCUDA_STATE", (g_test_dir + "/simcuda.state").c_str(), 1);
  ::setenv("SIMCUDA_DEVICE_MEM_MB", "512", 1);
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW);
  int rc;
  if (!lib || !::dlsym(lib, "simcuda_is_mapped")) {
    std::fprintf(stderr,
                 "skipped: libcuda.so.1 is not simcuda (run through ctest, which points LD_LIBRARY_PATH at it)\n");
    rc = 77;
  } else {
    rc = Catch::Session().run(argc, argv);
  }
  if (DIR* d = ::opendir(dir)) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ::unlink((g_test_dir + "/" + e->d_name).c_str());
    ::closedir(d);
  }
  ::rmdir(dir);
  return rc;
}
